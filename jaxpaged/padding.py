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


def quarter_octave(n: int, exact_upto: int) -> int:
    """A power of two up to ``exact_upto``, then the next of four steps per octave
    (``exact_upto`` 32: 40, 48, 56, 64, 80, 96, ...): padding of at most 25%, for four
    shapes per octave."""
    p = next_power_of_2(n)
    return p if p <= exact_upto else -(-n // (p // 8)) * (p // 8)


def row_bucket(n: int) -> int:
    """Padded number of sequences (and sampling rows) in a step: a power of two up to 32,
    then quarter-octave steps (40, 48, 56, 64, 80, 96, ...). Every padded row of a decode
    batch costs a full row of matmuls and attention: 48 sequences padded to 64 ran 1.29x
    slower on CPU than at 48."""
    return quarter_octave(n, 32)


def token_bucket(n: int, floor: int = 1) -> int:
    """Padded number of tokens in a step with prefill chunks: a power of two (at least
    ``floor``) up to 256, then quarter-octave steps (320, 384, 448, 512, 640, 768, ...).
    Continuous batching's busy steps are a full batch of decodes plus a prompt or two
    (Llama-3-8B's ShareGPT-like run: 256 + ~200 per admitted prompt, 488 tokens a step on
    average); powers of two padded 600-700 of them to 1,024, matmuls and all."""
    return quarter_octave(max(n, floor), 256)
