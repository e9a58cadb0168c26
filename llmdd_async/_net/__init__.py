"""Links between endpoints: one :class:`~llmdd_async._net.link.Link` per peer cluster.

The link layer sits between the scheduler above and the wire protocol, transports and device
adapters below: ``link`` (health, the socket's reader and writer, admission),
``link_manager`` (the listener, link set-up and races), ``handshake`` (authenticated
set-up), ``transfer`` (the initiator and the target of a request). It imports nothing from
the async API or the engine above it.
"""
