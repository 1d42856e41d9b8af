import cProfile, os, pstats, sys, time, io
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

def rank_fn(model_path, out):
    import torch
    from tests.main_leg import actor_configs
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    eng = MegatronEngine(*actor_configs(model_path, total_training_steps=1000))
    rank = torch.distributed.get_rank()
    times = []
    prof = cProfile.Profile()
    for step in range(1, 7):
        path = os.path.join(out, f"global_step_{step}", "actor")
        torch.distributed.barrier()
        t = time.monotonic()
        if step >= 4 and rank == 0: prof.enable()
        eng.save_checkpoint(path, global_step=step, max_ckpt_to_keep=2)
        if step >= 4 and rank == 0: prof.disable()
        times.append(time.monotonic() - t)
    if rank == 0:
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(70); open("/tmp/prof/save8_cum.txt","w").write(s.getvalue())
        s = io.StringIO(); st=pstats.Stats(prof, stream=s); st.sort_stats("tottime").print_stats(40); st.print_callers("__repr__|all_gather_object|barrier|broadcast|gather_object|_tensor_str.py:712"); open("/tmp/prof/save8_tot.txt","w").write(s.getvalue())
    return times, eng.last_committed.phase_seconds

if __name__ == "__main__":
    from verl.models.tiny import make_tiny_hf_model
    mp = make_tiny_hf_model("/tmp/prof/model")
    import shutil; shutil.rmtree("/tmp/prof/out", ignore_errors=True)
    res = run_on_ranks(rank_fn, 8, ParallelSizes(tp=2, pp=2, ep=2, etp=2), args=(mp, "/tmp/prof/out"), timeout_s=600)
    for r, (t, ph) in enumerate(res): print(r, [round(x,3) for x in t], {k: round(v,3) for k,v in ph.items()})
