"""rollout-engine: generation for RL rollouts, beside the trainer on the same GPUs."""
__version__ = "0.1.0"
