"""The auto chunk model: prompt length AND stage count decide, from measured costs."""
from engine.chunking import ChunkCost, chunk_bounds, choose_chunk, makespan

CANDS = (1024, 2048, 4096, 8192, 16384)
# per-layer seconds at each size: small chunks use the GPU less well (not a straight line)
LAYER_S = {1024: 0.0012, 2048: 0.0020, 4096: 0.0037, 8192: 0.0072, 16384: 0.0143}


def cost(host=0.0, attn=0.0, layers=16):
    return ChunkCost(LAYER_S, attn_s_per_token_key=attn, host_s_per_layer=host, layers_per_stage=layers)


def test_bounds_cover_the_prompt():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert sum(n for _, n in chunk_bounds(65536, 6144)) == 65536


def test_one_stage_takes_big_chunks_more_stages_take_smaller():
    one, _ = choose_chunk(65536, 1, cost(), CANDS)
    four, why = choose_chunk(65536, 4, cost(), CANDS)
    assert one == 16384 and four < one and "4 stage(s)" in why


def test_short_prompts_are_not_split_needlessly():
    assert choose_chunk(3000, 1, cost(), CANDS)[0] == 3000


def test_the_shared_host_bound_pushes_back_to_bigger_chunks():
    free, _ = choose_chunk(65536, 4, cost(host=0.0), CANDS)
    launch_bound, _ = choose_chunk(65536, 4, cost(host=0.002), CANDS)
    assert launch_bound > free


def test_interpolation_and_attention_term():
    c = cost(attn=1e-9, layers=1)
    assert c.t0(3072) == (LAYER_S[2048] + LAYER_S[4096]) / 2
    assert c.stage_time(1024, 8192) == LAYER_S[1024] + 1e-9 * 1024 * 8192
    assert makespan(4096, 4096, 2, c) == 2 * LAYER_S[4096]
