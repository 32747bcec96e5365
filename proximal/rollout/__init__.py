"""Rollout (the MDP of Ziegler et al. 2019; docs/formulas.md): sampling responses, masking what
follows the stop, scoring them."""
