"""Rollout (seed §1): sampling responses, masking what follows the stop, scoring them."""
