"""What a request may ask for: :class:`~specdec_rt.request.params.RequestParams` and the checks of
its options (stops, lengths, tool choice), shared by the Engine and the server."""
