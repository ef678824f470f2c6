"""posttrain flows."""
