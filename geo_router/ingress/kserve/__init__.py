"""The router's gRPC endpoint: KServe's Open Inference Protocol v2 with Triton's streaming
extension (service), its tensor convention (tensors), status mapping (status) and listener
(server). kserve_v2_pb2* are protoc's output (`make protos`)."""
