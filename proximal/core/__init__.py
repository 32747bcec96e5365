"""The mathematics of PPO-based RLHF (Schulman et al. 2015, 2017; Ziegler et al. 2019; Ouyang et al.
2022), DPO / SimPO, and GRPO / RLOO, as pure tensor functions; this package imports only torch.

Conventions, stated once (each module's docstring repeats the notation):

- Shapes: B batch size, T response length, V vocabulary size.
- ``response_mask`` is a bool (B, T) tensor, True = a real response token; values at False
  positions are never read (``torch.where``, not multiplication, so NaN/inf there cannot leak).
- Losses are returned for minimisation, with a dict of detached stats where they have one.
- ``docs/formulas.md`` writes out every equation and names the function that implements it.
"""

from proximal.core.advantages import (
    GROUP_SCALES,
    gae,
    group_advantages,
    kl_reward_advantages,
    last_valid_index,
    reinforce_pp_advantages,
    returns_to_go,
    rloo_advantages,
    shape_rewards,
    uniform_groups,
    whiten,
)
from proximal.core.cispo import cispo_policy_loss
from proximal.core.correction import (
    CORRECTIONS,
    correction_weights,
    mismatch_stats,
    sequence_correction_weights,
    sequence_mask_weights,
    tis_weights,
    token_mask_weights,
)
from proximal.core.distill import generalized_jsd, linear_generalized_jsd, reverse_kl_advantages
from proximal.core.fused import (
    DEFAULT_CHUNK_ELEMENTS,
    linear_logprobs,
    linear_sequence_logprobs,
    linear_token_kl,
)
from proximal.core.grpo import grpo_advantages, grpo_policy_loss
from proximal.core.gspo import gspo_policy_loss
from proximal.core.kl import (
    ESTIMATORS,
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    ProportionalKLController,
    kl_penalty,
    make_kl_controller,
    reference_kl_loss,
)
from proximal.core.logprobs import (
    filter_logits,
    filtered_logprobs_from_logits,
    logprobs_from_logits,
    sequence_logprobs,
    token_entropy,
    token_kl,
    truncates,
)
from proximal.core.losses import (
    bradley_terry_loss,
    entropy_from_logits,
    explained_variance,
    nll_from_logprobs,
    pair_mean,
    ppo_policy_loss,
    ptx_loss,
    sft_loss,
    token_nll,
    value_loss,
)
from proximal.core.preference import DPO_LOSS_TYPES, dpo_loss, simpo_loss
from proximal.core.stats import (
    AGGREGATIONS,
    aggregation_units,
    masked_aggregate,
    masked_mean,
    masked_mean_var,
    masked_sum,
    masked_var,
)
from proximal.core.surrogate import (
    SURROGATE_STATS,
    apply_dual_clip,
    clipped_ratio,
    clipped_surrogate_loss,
    pessimistic_surrogate,
    surrogate_stats,
)

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "DEFAULT_CHUNK_ELEMENTS",
    "DPO_LOSS_TYPES",
    "ESTIMATORS",
    "GROUP_SCALES",
    "KL_CONTROLLERS",
    "SURROGATE_STATS",
    "AdaptiveKLController",
    "FixedKLController",
    "ProportionalKLController",
    "apply_dual_clip",
    "bradley_terry_loss",
    "correction_weights",
    "cispo_policy_loss",
    "generalized_jsd",
    "linear_generalized_jsd",
    "reverse_kl_advantages",
    "clipped_ratio",
    "clipped_surrogate_loss",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "filter_logits",
    "filtered_logprobs_from_logits",
    "aggregation_units",
    "gae",
    "group_advantages",
    "gspo_policy_loss",
    "grpo_advantages",
    "grpo_policy_loss",
    "kl_penalty",
    "kl_reward_advantages",
    "last_valid_index",
    "linear_logprobs",
    "linear_sequence_logprobs",
    "linear_token_kl",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_aggregate",
    "masked_mean",
    "masked_mean_var",
    "masked_sum",
    "masked_var",
    "mismatch_stats",
    "nll_from_logprobs",
    "pair_mean",
    "pessimistic_surrogate",
    "ppo_policy_loss",
    "ptx_loss",
    "reference_kl_loss",
    "reinforce_pp_advantages",
    "returns_to_go",
    "rloo_advantages",
    "sequence_correction_weights",
    "sequence_mask_weights",
    "sequence_logprobs",
    "sft_loss",
    "shape_rewards",
    "simpo_loss",
    "surrogate_stats",
    "tis_weights",
    "token_entropy",
    "token_kl",
    "token_mask_weights",
    "token_nll",
    "truncates",
    "uniform_groups",
    "value_loss",
    "whiten",
]
