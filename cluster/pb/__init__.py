"""Generated protobuf/gRPC stubs (``make protos`` regenerates them from ``protos/``)."""

# What Ray Serve's gRPC proxy serves (serve.start / serveConfigV2 grpc_options): pdserve's API
# and the standard health service, both answered by the Router deployment.
GRPC_SERVICER_FUNCTIONS = [
    "cluster.pb.pdserve.v1.generation_pb2_grpc.add_GenerationServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
