"""How host arrays are padded for the device: the null block and power-of-two buckets. No jax here.

Block 0 of the KV pool is the null block: padding entries of block tables point at it and
padding tokens write into it, so it is never handed to a sequence. Padded axes round up to
powers of two (sequence counts past 32 to quarter octaves), which bounds the number of
distinct step shapes (and so of compilations).
"""

NULL_BLOCK = 0


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def bucket(n: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor)."""
    return next_power_of_2(max(n, floor))


def row_bucket(n: int) -> int:
    """Padded number of sequences (and sampling rows) in a step: a power of two up to 32,
    then quarter-octave steps (40, 48, 56, 64, 80, 96, ...). Every padded row of a decode
    batch costs a full row of matmuls and attention: 48 sequences padded to 64 ran 1.29x
    slower on CPU than at 48. This pads by at most 25%, for four shapes per octave."""
    p = next_power_of_2(n)
    return p if p <= 32 else -(-n // (p // 8)) * (p // 8)
