"""Offline tools for saved checkpoints (upstream verl's ``verl.model_merger``)."""
