import ray, sys, subprocess
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
@ray.remote(num_cpus=2, runtime_env={"env_vars": {"OMP_NUM_THREADS": "2"}})
class A:
    async def go(self, out):
        import asyncio, runpy, sys
        sys.argv = ["x", "thread", out]
        import io, contextlib
        def f():
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                runpy.run_path("/tmp/thread_train.py", run_name="__main__")
            return buf.getvalue().splitlines()[-1]
        return await asyncio.to_thread(f)
a = A.remote()
for i in range(2):
    print("in a Ray actor:", ray.get(a.go.remote(f"/tmp/at-{i}")))
