"""ardit's command-line client: ``ardit generate`` and ``ardit models`` over the REST API or gRPC."""
