"""posttrain stages."""
