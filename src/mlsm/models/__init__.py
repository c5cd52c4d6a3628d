"""Students and heads: HF encoders from AutoConfig, heads computed at target positions only."""
