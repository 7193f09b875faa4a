"""The embedded demo: its model (built and warm-started by SFT on scripted
demonstrations run through the real harness and proxy). It needs both the
learner and the rollout side, so it sits above them."""
