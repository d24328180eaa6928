"""The gRPC shell: servicers (validate, convert, call the state, reply), interceptors and
the server's lifecycle."""
