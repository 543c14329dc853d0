"""Model definitions keyed by the `architectures` entry of config.json."""
