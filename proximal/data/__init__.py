"""Datasets: prompts with their columns (online methods; :mod:`~proximal.data.prompts`), prompt /
response pairs and conversations (SFT; :mod:`~proximal.data.sft`, sequence packing in
:mod:`~proximal.data.packing`), preference pairs (reward model, DPO, SimPO;
:mod:`~proximal.data.preferences`), read from JSONL or Hugging Face datasets
(:mod:`~proximal.data.sources`, :mod:`~proximal.data.jsonl`), rendered by chat templates
(:mod:`~proximal.data.chat`), collated (:mod:`~proximal.data.collate`) and drawn by the
rank-sharded, resumable sampler (:mod:`~proximal.data.sampler`)."""
