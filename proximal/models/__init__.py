"""Models: loading Hugging Face checkpoints and tokenizers (:mod:`~proximal.models.loading`), the
heads (:mod:`~proximal.models.heads`), the output layer and the choice between fused and logits
log-probabilities (:mod:`~proximal.models.output`), the reward model (:mod:`~proximal.models.reward`),
policy, reference and critic with LoRA (:mod:`~proximal.models.policy`), FSDP2 and precision
(:mod:`~proximal.models.parallel`), compiled blocks (:mod:`~proximal.models.compiled`), the CPU
kernels (:mod:`~proximal.models.kernels`), model FLOPs (:mod:`~proximal.models.flops`) and tiny
test models (:mod:`~proximal.models.tiny`)."""
