"""RL math of the learner: advantages, policy losses, packing, step metrics.

- `advantages`: `compute_advantages(groups_of_rewards, "grpo" | "dr_grpo" | "rloo")`;
  reward None = ungraded (out of baseline and loss); zero-variance groups dropped
  and counted. New estimators: `@register_advantage("name")`.
- `losses`: pure per-token losses `fn(PolicyInputs, RLConfig) -> (loss, metrics)`
  ("ppo_clip", "gspo", "cispo"; `@register_loss("name")`), and `policy_loss`
  which adds sequence MIS and the KL-to-reference term. Token TIS caps the ratio
  inside each loss. Ratios are taken against the engine's behaviour logprobs.
- `aggregation`: token_mean / seq_mean_token_mean / constant as per-sequence
  weights plus one normaliser per optimizer step (exact accumulation).
- `batching`: `TrainSequence` → `pack_step(...) -> PackedStep` of fixed-shape
  micro-batches (length buckets, segment ids, positions, token budget).
- `metrics`: per-micro-batch sums/maxima merged across micro-batches.
"""
