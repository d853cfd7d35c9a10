"""A grammar's token bitmask applied to the logits (the torch form is
services/executor/constrain.py: apply_bitmask)."""
