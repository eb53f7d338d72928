"""Matching a recipe to a checkpoint: the recipe schema, the units of work, and the plan of every shard."""
