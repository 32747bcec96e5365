"""Training commands, one readable file per method: ``sft`` (supervised fine-tuning), ``reward``
(Bradley–Terry reward model) and ``ppo``. Each exposes a config dataclass, ``train(cfg)`` and ``cli(argv)``."""
