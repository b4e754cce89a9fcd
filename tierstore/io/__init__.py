"""Pack files and readers: the NVMe tier and the persistent quantization cache."""
