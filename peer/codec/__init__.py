"""Activation codecs of the pipeline links: the Bernoulli mask (mask.py) and the receiver-side token prior (prior.py)."""
