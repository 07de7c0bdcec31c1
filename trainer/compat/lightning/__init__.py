"""Lightning compatibility as one layer: Lightning's Trainer arguments and their refusals, its
spellings of defaults, the Trainer's Lightning-named properties. Deleting this folder removes only
Lightning-facing names."""
