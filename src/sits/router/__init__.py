"""L8 router: the fleet's front door in front of many `sits serve` replicas.

Its policies (registry, routing, latency prediction, canary) are pure and clock-injected, with no
HTTP and no asyncio, so they are tested exactly and reused by other request routers. This file
imports nothing, so importing one module of the package stays light.
"""
