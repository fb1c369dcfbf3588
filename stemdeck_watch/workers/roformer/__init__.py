"""The RoFormer engine: BS-RoFormer and Mel-Band RoFormer checkpoints as they are published.

architectures.py and layers.py are the two models, with the module tree (names and shapes)
of the published checkpoints; config.py reads and checks a checkpoint's YAML configuration;
checkpoint.py loads the weights (never an arbitrary pickle) and refuses any that do not fit
exactly; inference.py separates a song of any length chunk by chunk with overlap-add, in
memory bounded by the chunk; catalogue.py lists the published checkpoints with their
published scores and where they come from.

Importing this package imports nothing heavy; its modules import torch.
"""
