"""Test-only check of SGLang's CUDA-graph decode metadata after evictions, loaded into a
Triton-backend server through VASE_KV_EVICT_PLUGINS=triton_graph_check (tests/test_server_triton.py).

On a GPU, SGLang replays decode inside a CUDA graph, and the Triton backend then builds the
graph's metadata in its own buffers (`init_forward_metadata_out_graph` → `_apply_cuda_graph_metadata`:
kv_indptr, cuda_graph_kv_indices, cuda_graph_num_kv_splits) from `req_pool_indices`,
`req_to_token` and `seq_lens`, instead of `init_forward_metadata`. No graph runs on CPU, so
after every eager decode metadata build (the path this server runs) this module calls the
graph path on the same batch, CPU tensors, and compares what the two would read:

  - the same kv_indptr, kv_indices (each request's row, as rewritten by the eviction step, up
    to its shrunk length) and split counts;
  - every slot read is its row's (req_to_token) and none is free in the allocator (a page
    the step freed is never read).

Requests holding cells (shared budget scopes, not served under CUDA graphs) are left out.
Each check logs one line, `vase-graph-check: decode=<n> shrunk=<m> mismatch=<what or none>
control=<what or none>` (m: rows read shorter than their true length; control: the same check
with the rows' true, unshrunk lengths given to the graph path, which must find a mismatch),
which the test reads from the server's output.
"""

import logging

import torch

logger = logging.getLogger("vase_graph_check")


def _free_pages(allocator) -> torch.Tensor:
    parts = [p for p in (getattr(allocator, "free_pages", None),
                         getattr(allocator, "release_pages", None)) if p is not None]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def check(backend, forward_batch, skip_rows=()) -> str | None:
    """What differs between the eager and the graph metadata of this decode batch (None: the
    same), over the batch's requests but those in `skip_rows` (request-table rows)."""
    bs = forward_batch.batch_size
    md = backend.forward_metadata
    lens = forward_batch.seq_lens[:bs].long()
    total = int(lens.sum())
    eager_ptr = md.kv_indptr[: bs + 1].clone().long()
    eager_idx = md.kv_indices[: int(eager_ptr[-1])].clone().long()
    eager_splits = md.num_kv_splits[:bs].clone().long()
    if getattr(backend, "cuda_graph_kv_indices", None) is None:
        backend.init_cuda_graph_state(max_bs=backend.req_to_token.shape[0],
                                      max_num_tokens=backend.req_to_token.shape[0],
                                      kv_indices_buf=torch.zeros(total, dtype=torch.int64))
    if backend.cuda_graph_kv_indices.numel() < total:
        backend.cuda_graph_kv_indices = torch.zeros(2 * total, dtype=torch.int64)
    saved_ptr = backend.kv_indptr[: bs + 1].clone()
    backend.init_forward_metadata_out_graph(forward_batch, in_capture=False)
    graph_ptr = backend.kv_indptr[: bs + 1].clone().long()
    graph_idx = backend.cuda_graph_kv_indices[:total].clone().long()
    graph_splits = backend.cuda_graph_num_kv_splits[:bs].clone().long()
    backend.kv_indptr[: bs + 1].copy_(saved_ptr)  # the eager path may read a view of it
    problems = set()
    page = getattr(backend.token_to_kv_pool_allocator, "page_size", 1) or 1
    free = _free_pages(backend.token_to_kv_pool_allocator).long()
    rows = forward_batch.req_pool_indices[:bs].tolist()
    for i, (row, n) in enumerate(zip(rows, lens.tolist())):
        if row in skip_rows:
            continue
        eager = eager_idx[eager_ptr[i]:eager_ptr[i + 1]]
        graph = graph_idx[graph_ptr[i]:graph_ptr[i + 1]]
        if not torch.equal(eager, graph):
            problems.add("kv_indices")
        if eager_splits[i] != graph_splits[i]:
            problems.add("num_kv_splits")
        if not torch.equal(graph, backend.req_to_token[row, :n].long()):
            problems.add("not the row")
        if torch.isin(graph // page, free).any():
            problems.add("freed pages read")
    return ", ".join(sorted(problems)) or None


def shrunk_rows(forward_batch, skip_rows=()) -> int:
    """Rows read shorter than their true length (positions carry the eviction offset,
    model_runner.after_forward_batch_init), but those in `skip_rows`: the requests this step
    reads compacted."""
    bs = forward_batch.batch_size
    shrunk = (forward_batch.positions[:bs] + 1 > forward_batch.seq_lens[:bs]).tolist()
    rows = forward_batch.req_pool_indices[:bs].tolist()
    return sum(1 for s, row in zip(shrunk, rows) if s and row not in skip_rows)


def _install():
    try:
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    except ImportError:
        return
    original = TritonAttnBackend.init_forward_metadata
    if getattr(original, "_vase_graph_check", False):
        return

    def init_forward_metadata(self, forward_batch):
        out = original(self, forward_batch)
        if not forward_batch.forward_mode.is_decode():
            return out
        from vase_sglang_patches import runtime

        rt = runtime.RUNTIME
        skip = rt.cell_views if rt is not None else ()
        mismatch = check(self, forward_batch, skip_rows=skip)
        shrunk = shrunk_rows(forward_batch, skip)
        control = None
        if shrunk:
            # negative control: the graph path given the rows' true lengths (what a step that
            # forgot to shrink seq_lens would leave) must not read what the eager path reads
            bs, saved = forward_batch.batch_size, forward_batch.seq_lens
            forward_batch.seq_lens = (forward_batch.positions[:bs] + 1).to(saved.dtype)
            try:
                control = check(self, forward_batch, skip_rows=skip)
            finally:
                forward_batch.seq_lens = saved
        logger.warning("vase-graph-check: decode=%d shrunk=%d mismatch=%s control=%s",
                       forward_batch.batch_size, shrunk, mismatch or "none", control or "none")
        return out

    init_forward_metadata._vase_graph_check = True
    TritonAttnBackend.init_forward_metadata = init_forward_metadata


_install()
