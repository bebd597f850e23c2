"""The router's process: it listens, loads what is preloaded, forwards requests, unloads what idles, and on the
first SIGTERM or SIGINT stops taking connections, lets every model's server drain its own requests (each under its
``drain_timeout``), and exits 0. A second signal stops the servers without waiting. No MLX.
"""

from __future__ import annotations

import signal

import anyio
import structlog

from neuron.config.settings import HttpLimits
from neuron.router.app import FORWARDED, Router
from neuron.router.fleet import Fleet
from neuron.server.guard import Allowed, Guard, split_list
from neuron.server.listener import HttpServer, bind
from neuron.system import systemd

log = structlog.get_logger("neuron.router")


async def serve(router: Router, fleet: Fleet, host: str, port: int, http: HttpLimits) -> None:
    sock = bind(host, port)
    allowed = Allowed.build(split_list(http.allowed_origins), split_list(http.allowed_hosts), listen=host)
    app = Guard(router.app(), allowed, ("/models/load", "/models/unload", *FORWARDED))
    server = HttpServer.listening(app, http)
    notifier = systemd.Notifier()
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        tg.start_soon(fleet.run, tg)
        log.info("serving", host=host, port=sock.getsockname()[1], models=list(fleet.children))
        notifier.send("READY=1", f"STATUS=routing {len(fleet.children)} models")
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal received", signal=signal.Signals(signum).name)
                break
            notifier.send("STOPPING=1")
            for listener in server.servers:
                listener.close()  # no new connections; those open get their answers
            async with anyio.create_task_group() as stopping:
                stopping.start_soon(fleet.stop)

                async def second() -> None:
                    async for signum in signals:
                        log.info("signal received again: stopping without waiting", signal=signal.Signals(signum).name)
                        await fleet.kill()
                        return

                stopping.start_soon(second)
                await fleet.stopped.wait()
                stopping.cancel_scope.cancel()
        server.stop()
        await router.client.aclose()
        tg.cancel_scope.cancel()
    log.info("stopped")
