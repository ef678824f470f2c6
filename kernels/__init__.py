"""posttrain kernels."""
