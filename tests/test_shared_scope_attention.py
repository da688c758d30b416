"""The torch_native decode of a batch with requests holding cells (patches/shared_scope.py):
SGLang's own per-request SDPA loop (`TorchNativeAttnBackend._run_sdpa_forward_decode`, called
here in-process on small tensors) attends only the other requests, so no pass is computed and
thrown away for the requests the cell hook attends itself (issue 59). The served results of
the cell attention are tested in tests/test_server_shared_scope.py and test_server_triton.py."""

import inspect

import torch

torch.set_num_threads(1)


def _sglang_sdpa_decode():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    fn = inspect.unwrap(TorchNativeAttnBackend.__dict__["_run_sdpa_forward_decode"])
    return fn, object.__new__(TorchNativeAttnBackend)  # the loop reads nothing of self


def _batch(seed=0, b=4, q_heads=4, kv_heads=2, d=8, slots=96, width=20):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(slots, kv_heads, d, generator=gen)
    v_cache = torch.randn(slots, kv_heads, d, generator=gen)
    req_to_token = torch.randperm(slots, generator=gen)[: b * width].reshape(b, width)
    seq_lens = torch.tensor([5, 17, 9, 20][:b])
    query = torch.randn(b, q_heads, d, generator=gen)
    return query, k_cache, v_cache, req_to_token, torch.arange(b), seq_lens


def _run(fn, backend, query, k_cache, v_cache, req_to_token, rows, seq_lens, around=None):
    from vase_sglang_patches import shared_scope

    output = torch.full_like(query, float("nan"))
    args = (query, output, k_cache, v_cache, req_to_token, rows, seq_lens)
    kwargs = dict(scaling=0.3, enable_gqa=True)
    if around is None:
        fn(backend, *args, **kwargs)
    else:
        shared_scope.around_sdpa_decode(fn, backend, *args, **kwargs)
    return output


def test_the_sdpa_loop_skips_the_requests_holding_cells():
    from vase_sglang_patches import shared_scope

    fn, backend = _sglang_sdpa_decode()
    batch = _batch()
    full = _run(fn, backend, *batch)
    assert not full.isnan().any()
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[7].tolist())  # the seq_lens SGLang's loop is given
        return fn(*args, **kwargs)

    token = shared_scope._CELL_ROWS.set(frozenset({1, 3}))
    try:
        part = _run(counted, backend, *batch, around=True)
    finally:
        shared_scope._CELL_ROWS.reset(token)
    assert calls == [[5, 9]]  # only requests 0 and 2 were attended
    assert torch.equal(part[[0, 2]], full[[0, 2]])
    assert part[[1, 3]].isnan().all()  # left for the cell hook, never computed


def test_without_cells_the_loop_is_sglangs():
    from vase_sglang_patches import shared_scope

    fn, backend = _sglang_sdpa_decode()
    batch = _batch(seed=1)
    assert torch.equal(_run(fn, backend, *batch), _run(fn, backend, *batch, around=True))
    token = shared_scope._CELL_ROWS.set(frozenset({0, 1, 2, 3}))
    try:
        calls = []
        out = _run(lambda *a, **k: calls.append(1), backend, *batch, around=True)
    finally:
        shared_scope._CELL_ROWS.reset(token)
    assert calls == [] and out.isnan().all()  # every request holds cells: SGLang's loop not run
