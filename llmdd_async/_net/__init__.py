"""Links between endpoints: one :class:`~llmdd_async._net.link.Link` per peer cluster.

The link layer sits between the scheduler above and the wire protocol, transports and device
adapters below: ``link`` (health, the socket's reader and writer, admission),
``link_manager`` (link set-up, unlink and the races between them), ``listener`` (accepting,
with the cap on handshakes in progress), ``handshake`` (authenticated set-up),
``side_channel`` and ``local_peer`` (the same-host proof and the kernel facts under it),
``comm_domains`` (HCCL-style domains over the links), ``initiator`` / ``target`` (the two
sides of a request). It imports nothing from the async API or the engine above it.
"""
