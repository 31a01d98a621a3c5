"""The sampler's noise: the int32 tensor hash is the plain-Python `mix32` bit for bit (seeds and
steps past 2**31 included), so a row's tokens depend on its seed alone, on any device."""

from __future__ import annotations

import pytest
import torch

from services.rollout.sampling import _mix32, gumbel_noise, mix32, vocab_hashes

pytestmark = pytest.mark.unit


def test_tensor_hash_is_the_python_hash_bit_for_bit():
    values = [0, 1, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 1, 0x9E3779B1, 123456789]
    values += torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    got = _mix32(torch.tensor(values, dtype=torch.long).to(torch.int32)).to(torch.long) & 0xFFFFFFFF
    assert got.tolist() == [mix32(v) for v in values]


@pytest.mark.parametrize("step", [0, 3, 2**20 + 1])
def test_noise_is_the_documented_function_of_seed_step_and_token(step):
    seeds = [0, 2**31 + 5, 2**32 - 1]
    vocab = 50
    noise = gumbel_noise(torch.tensor(seeds, dtype=torch.long), step, vocab_hashes(vocab, torch.device("cpu")))
    for row, seed in enumerate(seeds):
        key = mix32((seed + step * 0x9E3779B1) & 0xFFFFFFFF)
        for token in (0, 17, vocab - 1):
            u = ((mix32(key ^ mix32(token)) >> 8) + 0.5) / (1 << 24)
            want = -torch.log(-torch.log(torch.tensor(u, dtype=torch.float32)))
            assert noise[row, token].item() == want.item()
    assert bool(torch.isfinite(noise).all())
