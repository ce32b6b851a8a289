"""Reference model definitions (built from configs; pretrained weights only from local paths)."""
