"""protoc's output for proto/verifier/v1/verifier.proto, committed; the rest of the code imports it
through `verifier.rpc`.

verifier_pb2.py and verifier_pb2.pyi are written by `python -m verifier.rpc.build`: never edit them.
They live here because protoc names modules after the proto's path (`verifier/v1/verifier.proto` ->
`verifier.v1.verifier_pb2`): this subpackage of ours is where that name lands, so the generated files
stay untouched and the registered file name stays "verifier/v1/verifier.proto". There is no generated
service module: `verifier.rpc` builds the stub and the servicer handler from the service's descriptor.
"""
