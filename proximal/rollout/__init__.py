"""Rollout (the MDP of Ziegler et al. 2019; docs/formulas.md): sampling responses (the engine,
:mod:`~proximal.rollout.engine`, and its lean decode step, :mod:`~proximal.rollout.decode`; masking
what follows the stop, :mod:`~proximal.rollout.sampling`), calling reward functions
(:mod:`~proximal.rollout.reward_functions`), scoring the responses (:mod:`~proximal.rollout.scoring`),
collecting a step's scored batch (:mod:`~proximal.rollout.collect`) and its experience
(:mod:`~proximal.rollout.experience`)."""
