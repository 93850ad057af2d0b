"""The checkout's examples (not installed): scripts the suite runs, ``grpo`` (the demo), ``seed_metrics``."""
