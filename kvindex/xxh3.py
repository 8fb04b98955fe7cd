"""Chained xxh3-64 over equal chunks, compiled: the prompt's block hashes in one loop.

`kvindex.hashing` chains xxh3-64 (block i seeded with block i-1's hash). Through the `xxhash` library
that is one Python call per block: ~200 ns each, ~400 us for the 2,048 blocks of a 32k-token prompt,
the largest part of the gateway's own work on such a request. Here the same function runs as a
compiled loop (`scoring/jit.py`), for the chunk sizes the gateway uses (17 to 240 bytes, a multiple of
8: block sizes 6 to 60 tokens, even; 16 and 32 in practice), where xxh3 is a short sequence of
16-byte multiply-folds. Other sizes use the library. The results equal the library's bit for bit:
`tests/unit/test_xxh3.py` compares them over every size this module takes, with random data and seeds.

The algorithm is xxh3's (Yann Collet's xxHash, BSD-2-Clause): the default secret, the mid-size paths
for 17-128 and 129-240 bytes, and the avalanche. 64x64 -> 128-bit products are built from 32-bit
halves, as xxHash's portable code does.
"""

from __future__ import annotations

import sys

import numpy as np
import numpy.typing as npt

from scoring.jit import kernel

U64Array = npt.NDArray[np.uint64]

_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
# The secret's little-endian 64-bit word at every byte offset (the mid-size paths read odd offsets).
_SECRET_AT = np.array(
    [int.from_bytes(_SECRET[i : i + 8], "little") for i in range(len(_SECRET) - 7)], dtype=np.uint64
)
_PRIME64_1 = np.uint64(0x9E3779B185EBCA87)
_PRIME_MX1 = np.uint64(0x165667919E3779F9)
_LOW32 = np.uint64(0xFFFFFFFF)
_U32, _U37 = np.uint64(32), np.uint64(37)
_MIN_BYTES, _MAX_BYTES, _SMALL_MAX = 17, 240, 128
_SECRET_SIZE_MIN, _MID_START, _MID_LAST = 136, 3, 17


def compiled_size(chunk_bytes: int) -> bool:
    """Whether `chained` takes chunks of this size (else hash them with the library)."""
    little = sys.byteorder == "little"  # the data is read as native 64-bit words
    return little and _MIN_BYTES <= chunk_bytes <= _MAX_BYTES and chunk_bytes % 8 == 0


def chained(data: bytes, chunk_bytes: int, root: int) -> U64Array:
    """xxh3-64 of every full `chunk_bytes` chunk of `data`, chunk i seeded with chunk i-1's hash and
    chunk 0 with `root`. Only for `compiled_size(chunk_bytes)`."""
    blocks = len(data) // chunk_bytes
    words = np.frombuffer(data, dtype=np.uint64, count=blocks * chunk_bytes // 8)
    hashes = np.empty(blocks, dtype=np.uint64)
    _chain(words, chunk_bytes // 8, np.uint64(root), hashes)
    return hashes


@kernel
def _chain(words: U64Array, chunk_words: int, seed: np.uint64, hashes: U64Array) -> None:
    for block in range(hashes.shape[0]):
        seed = _xxh3_mid(words, block * chunk_words, chunk_words, seed)
        hashes[block] = seed


@kernel
def _xxh3_mid(words: U64Array, at: int, n: int, seed: np.uint64) -> np.uint64:
    """xxh3-64 of the 8n bytes from word `at` (17 <= 8n <= 240)."""
    length = 8 * n
    acc = np.uint64(length) * _PRIME64_1
    if length <= _SMALL_MAX:
        pairs = 1 + (length > 32) + (length > 64) + (length > 96)  # 16-byte pairs from each end
        for i in range(pairs - 1, -1, -1):
            acc += _mix16(words, at + 2 * i, 32 * i, seed)
            acc += _mix16(words, at + n - 2 * (i + 1), 32 * i + 16, seed)
        return _avalanche(acc)
    for i in range(8):
        acc += _mix16(words, at + 2 * i, 16 * i, seed)
    last = _mix16(words, at + n - 2, _SECRET_SIZE_MIN - _MID_LAST, seed)
    acc = _avalanche(acc)
    for i in range(8, length // 16):
        last += _mix16(words, at + 2 * i, 16 * (i - 8) + _MID_START, seed)
    return _avalanche(acc + last)


@kernel
def _mix16(words: U64Array, at: int, secret_at: int, seed: np.uint64) -> np.uint64:
    low = words[at] ^ (_SECRET_AT[secret_at] + seed)
    high = words[at + 1] ^ (_SECRET_AT[secret_at + 8] - seed)
    return _fold(low, high)


@kernel
def _fold(a: np.uint64, b: np.uint64) -> np.uint64:
    """The 128-bit product of a and b, its two halves XOR-ed."""
    a_low, a_high, b_low, b_high = a & _LOW32, a >> _U32, b & _LOW32, b >> _U32
    low_low, high_low, low_high = a_low * b_low, a_high * b_low, a_low * b_high
    cross = (low_low >> _U32) + (high_low & _LOW32) + low_high
    upper = (high_low >> _U32) + (cross >> _U32) + a_high * b_high
    lower = (cross << _U32) | (low_low & _LOW32)
    return lower ^ upper


@kernel
def _avalanche(h: np.uint64) -> np.uint64:
    h ^= h >> _U37
    h *= _PRIME_MX1
    return h ^ (h >> _U32)


def compile_kernels() -> None:
    """Compile (or load from numba's cache) for the types the hashing step calls with."""
    chained(bytes(64), 64, 1)
