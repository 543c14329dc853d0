"""The wire contract every process shares, standard library only (no torch): the serving config
``dasc-serve`` builds from its flags (``serve_config``), the typed messages between the front
end, the scheduler and the ranks (``messages``, ``rank_messages``), and the transport that moves
them and decodes nothing else (``ipc``)."""
