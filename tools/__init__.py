"""Command-line tools: writing the tiny model, starting every service at once."""
