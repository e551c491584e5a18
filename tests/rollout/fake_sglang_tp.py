"""A stand-in SGLang server of several GPUs (``--tp-size N``) for the disaggregated tests: like SGLang's TP
schedulers, each of its N ranks is a process of its own that joins the trainer's weight-update group at
``rank_offset + tp_rank`` and receives every announced bucket by broadcast. Rank 0 is the HTTP server's process
(``FakeSGLang``); ranks 1.. are forked from it before it serves. ``GET /fake/rank_checksums`` lists, per TP
rank, the hashes of the parameters it received (each rank keeps whole tensors: the fake does not shard)."""

import multiprocessing
import os

from tests.rollout.fake_sglang import FakeSGLang


def _tp_rank(tp_rank, pipe, hash_fn):
    """One TP rank's loop: ``("join", body)``, ``("receive", body)``, ``("destroy", body)``, ``None`` to stop;
    answers each with the route's ``(status, answer)``, a receive with this rank's checksums."""
    rank = FakeSGLang(hash_fn=hash_fn)  # its routes, not its HTTP server
    while (message := pipe.recv()) is not None:
        action, body = message
        if action == "join":
            pipe.send(rank.join_group({**body, "rank_offset": body["rank_offset"] + tp_rank}))
        elif action == "receive":
            status, _ = rank.receive_bucket(body)
            pipe.send((status, dict(rank.checksums)))
        else:
            pipe.send(rank.route("/destroy_weights_update_group", body))


class FakeTPSGLang(FakeSGLang):
    def __init__(self, tp_size=2, **options):
        super().__init__(**options)
        # os.fork, not multiprocessing: the server itself runs as a daemon process, which may not have children
        # of multiprocessing's; forked before any thread of this process starts
        self.pipes, self.ranks = [], []
        for tp_rank in range(1, tp_size):
            ours, theirs = multiprocessing.Pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    _tp_rank(tp_rank, theirs, self.hash_fn)
                finally:
                    os._exit(0)
            self.pipes.append(ours)
            self.ranks.append(pid)
        self.rank_checksums = [{} for _ in self.pipes]

    def _all_ranks(self, action, body, own):
        """Send ``action`` to ranks 1.., run ``own()`` as rank 0 meanwhile (the group's collectives need every
        rank at once), then collect their answers; rank 0's answer is returned unless another rank failed."""
        for pipe in self.pipes:
            pipe.send((action, body))
        answer = own()
        others = [pipe.recv() for pipe in self.pipes]
        failed = [a for a in others if a[0] != 200]
        return (failed[0] if failed else answer), [a[1] for a in others]

    def join_group(self, body):
        answer, _ = self._all_ranks("join", body, lambda: super(FakeTPSGLang, self).join_group(body))
        return answer

    def receive_bucket(self, body):
        answer, checksums = self._all_ranks("receive", body, lambda: super(FakeTPSGLang, self).receive_bucket(body))
        self.rank_checksums = checksums
        return answer

    def route(self, path, body):
        if path == "/fake/rank_checksums":
            return 200, [self.checksums, *self.rank_checksums]
        if path == "/destroy_weights_update_group" and self.group is not None:
            answer, _ = self._all_ranks("destroy", body, lambda: super(FakeTPSGLang, self).route(path, body))
            return answer
        return super().route(path, body)

    def __exit__(self, *exc):
        for pipe, pid in zip(self.pipes, self.ranks):
            pipe.send(None)
            os.waitpid(pid, 0)
        super().__exit__(*exc)
