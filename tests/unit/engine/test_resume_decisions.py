"""Resuming after a lost group, decided without a process: whom a loss is blamed on, what a paused sequence is fed
again, how many losses it may take, and a sampler that starts where it stood (the end-to-end proof is
tests/e2e/faults/test_resume.py)."""

from __future__ import annotations

import socket
import threading

import mlx.core as mx
import pytest

from neuron.engine import resume
from neuron.engine.sequence import Pause, Status
from neuron.launch import dataplane
from neuron.rank.head.sampler import Sampler, rewound
from neuron.rpc import Decode, Prefill, StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import NOT_ASKED, Sampled, Start, Step
from testkit.scheduling import apply, next_step, request, run, scheduler

LOST = Pause("lost", 1, "mac2", "rank 1 died", 0.0)


def test_a_loss_is_blamed_on_the_prompts_being_fed_else_on_the_whole_step() -> None:
    a, b, c = request(3), request(3), request(3)
    feeding = Step(StepPlan(prefill=[Prefill(c.no, 0, c.prompt, True)], decode=[Decode(a.no, 5, 0)]))
    assert resume.blamed(feeding, [a, b, c]) == {c}
    decoding = Step(StepPlan(decode=[Decode(a.no, 5, 0), Decode(b.no, 6, 0)]))
    assert resume.blamed(decoding, [a, b, c]) == {a, b}
    assert resume.blamed(None, [a, b, c]) == {a, b, c}  # a worker that died between steps


def test_the_lost_rank_is_a_workers_rather_than_rank_0s_which_only_stopped_waiting() -> None:
    lost = resume.lost({0: "abandoned", 2: "SIGKILL", 1: "no reply"}, ["here", "mac2", "mac3"], "cause")
    assert (lost.rank, lost.host, lost.cause) == (1, "mac2", "cause")
    assert resume.lost({0: "collective failed"}, ["here"], "c").rank == 0


def test_a_paused_sequence_is_fed_its_prompt_and_output_again_and_goes_on_where_it_stopped() -> None:
    s = scheduler(max_batch=4, prefill_chunk=64)
    a, b = request(4), request(3)
    for seq in (a, b):
        s.queues.add(seq)
    run(s, {a.no: ord("x"), b.no: ord("p")})  # both prompts, a first token each
    run(s, {a.no: ord("y"), b.no: ord("q")})
    assert a.output == [ord("x"), ord("y")] and a.completion_tokens == 2
    paused, given_up, _ = s.queues.pause(LOST, {a, b}, tries=2)
    assert paused == [a, b] and given_up == [] and list(s.waiting) == [a, b] and not s.batch
    assert a.replay == [*a.prompt, ord("x"), ord("y")] and a.losses == 1 and a.paused == LOST
    assert a.status == Status.WAITING
    turn = s.schedule()
    assert turn.admitted == [a, b]
    step = turn.step
    assert step is not None
    # Blamed before, each is fed alone, so that another loss is blamed on the one being fed.
    assert step.plan.prefill == [Prefill(a.no, 0, a.replay, True)]
    assert step.starts[a.no] == Start(a.params, (), (ord("x"), ord("y")))  # its sampler goes on from 2 tokens
    (delivery,) = apply(s, step, {a.no: Sampled(ord("z"), NOT_ASKED)})
    # Its stream goes on: the third token, no "first token" again, usage counts what the client got once.
    assert (delivery.sampled.token, delivery.kept, delivery.first) == (ord("z"), True, False)
    assert a.completion_tokens == 3 and a.fed == len(a.prompt) + 2
    assert next_step(s).plan.prefill == [Prefill(b.no, 0, b.replay, True)]


def test_a_blamed_sequence_first_in_line_is_fed_without_the_unblamed_ones_behind_it() -> None:
    s = scheduler(max_batch=4, prefill_chunk=64)
    a, b = request(4), request(3)
    for seq in (a, b):
        s.queues.add(seq)
    run(s, {a.no: ord("x"), b.no: ord("p")})
    s.queues.pause(LOST, {a}, tries=2)  # only a was blamed: b goes on after it, not beside it
    assert [chunk.seq for chunk in next_step(s).plan.prefill] == [a.no]


def test_a_sequence_lost_before_its_first_token_starts_afresh() -> None:
    s = scheduler(prefill_chunk=2)
    a = request(5, prompt_logprobs=1)
    s.queues.add(a)
    run(s)  # two of its five prompt tokens
    s.queues.pause(LOST, {a}, tries=2)
    step = next_step(s)
    assert step.plan.prefill == [Prefill(a.no, 0, a.prompt[:2], False, [], True)]  # scored: nothing was sent yet
    assert step.starts[a.no] == Start(a.params, (), ())  # its constraint, if any, rewinds to the start


def test_a_sequence_blamed_more_than_the_tries_is_given_up_and_the_others_resume() -> None:
    s = scheduler()
    killer, other = request(3), request(3)
    for seq in (killer, other):
        s.queues.add(seq)
    run(s)
    for losses in (1, 2):
        paused, given_up, _ = s.queues.pause(LOST, {killer}, tries=2)
        assert paused == [killer, other] and given_up == [] and killer.losses == losses
        s.schedule()
        s.schedule()
    paused, given_up, _ = s.queues.pause(LOST, {killer}, tries=2)
    assert given_up == [killer] and paused == [other] and other.losses == 0
    assert killer.status == Status.FINISHED_ERROR
    assert "3 times" in resume.too_many_losses(killer, 2, "rank 1 died")


def test_n_choices_resume_each_on_its_own() -> None:
    s = scheduler(max_batch=4)
    original, copy = request(3), request(3)
    original.copies, copy.copy_of = [copy], original
    s.queues.add(original)
    apply(s, next_step(s), {original.no: Sampled(ord("a"), NOT_ASKED), copy.no: Sampled(ord("b"), NOT_ASKED)})
    s.queues.pause(LOST, set(), tries=2)
    turn = s.schedule()
    assert original.n == 1 and turn.admitted == [original, copy]
    assert turn.step is not None
    plan = turn.step.plan
    assert plan.prefill == [
        Prefill(original.no, 0, [*original.prompt, ord("a")], True),
        Prefill(copy.no, 0, [*copy.prompt, ord("b")], True),
    ]


@pytest.mark.parametrize("produced", [0, 1, 5])
def test_a_resumed_sampler_draws_what_it_would_have_drawn(produced: int) -> None:
    params = SamplingParams(temperature=0.9, seed=3)
    logits = mx.random.normal((8, 50), key=mx.random.key(0))
    whole = Sampler(params)
    tokens = [whole(row).token for row in logits]
    resumed = Sampler(params, tuple(tokens[:produced]))
    assert [resumed(row).token for row in logits[produced:]] == tokens[produced:]
    started_afresh = Sampler(params)
    assert [started_afresh(row).token for row in logits[produced:]] != tokens[produced:] or produced == 0


def test_the_key_is_split_once_per_token() -> None:
    key = mx.random.key(9)
    for _ in range(3):
        key = mx.random.split(key)[0]
    assert mx.array_equal(rewound(9, 3), key).item() and not mx.array_equal(rewound(9, 2), key).item()


def test_cutting_a_groups_connections_frees_a_thread_waiting_on_them_and_nothing_else() -> None:
    """What frees rank 0 from a collective for a peer that is stopped or out of reach (``Pool.recover``)."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_server(("127.0.0.1", 0)) as bystander:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client, server.accept()[0]:
            received: list[bytes] = []
            waiting = threading.Thread(target=lambda: received.append(client.recv(10)))
            waiting.start()
            assert dataplane.cut([[f"127.0.0.1:{port}"]]) == 3  # the listener, and both ends of the connection
            waiting.join(5)
            assert received == [b""] and not waiting.is_alive()
        bystander.settimeout(0.01)
        with pytest.raises(TimeoutError):
            bystander.accept()  # still listening: another address is left alone


def test_a_sink_under_a_groups_connections_completes_every_transfer_a_silent_peer_never_would() -> None:
    """What lets rank 0's queued collectives complete when its peer is stopped or out of reach (``Sink``): sends
    drain, receives get zeros, on the very descriptors MLX holds; once the descriptor is closed, the sink ends."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        with server.accept()[0]:  # the peer: never reads, never writes
            client.setblocking(False)  # as the ring's socket threads set theirs
            sink = dataplane.Sink()
            try:
                assert sink.replace([[f"127.0.0.1:{port}"]]) == 2  # the connection's two ends in this process
                sent, received = 0, b""
                for _ in range(2000):
                    try:
                        sent += client.send(bytes(1 << 16))
                        received += client.recv(1 << 16)
                    except BlockingIOError:
                        threading.Event().wait(0.001)
                    if sent > 4 << 20 and len(received) > 1 << 20:
                        break
                assert sent > 4 << 20 and len(received) > 1 << 20 and not any(received)
            finally:
                client.close()
                sink.close()
