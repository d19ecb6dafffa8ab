"""The decode benchmark's read ceiling (`bench.kv_read`): per (batch row, KV head), its programs'
sums add up to that sequence's K + V over its first n rows, dense and through a shuffled page
table, in float64."""

import pytest
import torch
from fk_runtime import sizing
from fk_runtime.harness import testing

from fk_attention import bench

B, HK, CAPACITY, D = 2, 2, 56, 16
LENGTHS = [45, 29]  # odd, no multiple of any block below; rows past them hold data that must not count


def expected(k, v, lengths):
    return torch.stack([torch.stack([k[b, h, :n].double().sum() + v[b, h, :n].double().sum()
                                     for h in range(k.shape[1])]) for b, n in enumerate(lengths)])


# (page size, rows per block): one page per block (page a multiple of the block), a page per row
# (pages smaller than the block; 0, the default block, too), and the benchmark's page size.
@pytest.mark.parametrize("page, block_n", [(8, 4), (4, 8), (8, 16), (8, 0), (64, 64)])
def test_kv_read_sums_the_first_n_rows(page, block_n):
    # Positive values (fresh each run): a skipped or extra row moves the sum by ~8 per tensor.
    k, v = (torch.rand(B, HK, CAPACITY, D).to(testing.device()) for _ in range(2))
    lengths = torch.tensor(LENGTHS, dtype=torch.int32, device=k.device)
    want = expected(k.cpu(), v.cpu(), LENGTHS)
    dense = bench.kv_read(k, v, lengths, block_n=block_n)
    per_seq = sizing.cdiv(CAPACITY, page)
    order = torch.randperm(B * per_seq).to(torch.int32).view(B, per_seq).to(k.device)
    paged = bench.kv_read(bench.paged_copy(k, page, order), bench.paged_copy(v, page, order), lengths, block_table=order,
                          page_size=page, block_n=block_n)
    for got in (dense, paged):
        assert got.dtype == torch.float32 and got.shape[:2] == (B, HK)
        assert got.shape[2] > 1 or block_n in (0, 64)  # several chunks walk several blocks each
        torch.testing.assert_close(got.double().sum(-1).cpu(), want, rtol=1e-5, atol=1e-3)


def test_kv_read_takes_an_int_length():
    k, v = (testing.randn((B, HK, CAPACITY, D), torch.float32) for _ in range(2))
    got = bench.kv_read(k, v, 37, block_n=8)
    torch.testing.assert_close(got.double().sum(-1).cpu(), expected(k.cpu(), v.cpu(), [37] * B),
                               rtol=1e-5, atol=1e-3)
