"""Training commands, one readable file per method: ``sft`` (supervised fine-tuning), ``reward``
(the Bradley–Terry reward model of ``proximal rm``), ``dpo`` (DPO and SimPO on preference pairs),
``ppo``, and ``grpo`` (GRPO and its variants, RLOO among them). Each keeps its config in
``<method>_config.py`` and exposes ``train(cfg)`` and its command line (``cli(argv)``; ``dpo_cli`` and
``simpo_cli`` for the two offline preference methods)."""
