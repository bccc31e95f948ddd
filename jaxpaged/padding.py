"""How host arrays are padded for the device: the null block and power-of-two buckets. No jax here.

Block 0 of the KV pool is the null block: padding entries of block tables point at it and
padding tokens write into it, so it is never handed to a sequence. Padded axes round up to
powers of two, which bounds the number of distinct step shapes (and so of compilations).
"""

NULL_BLOCK = 0


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def bucket(n: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor)."""
    return next_power_of_2(max(n, floor))
