"""The Tandem API's methods on a grpc server, as the generated add_TandemServicer_to_server
registers them, except that a request that does not parse reaches the method as Undecodable
(answered INVALID_ARGUMENT) instead of failing in grpc's deserializer (answered INTERNAL)."""

import grpc

from shared.api import tandem_pb2 as pb


class Undecodable:
    """A request body that is not the message it should be (garbage, invalid UTF-8 in a string)."""

    def __init__(self, error: Exception):
        self.error = error


def _lenient(message_type):
    """A deserializer that never raises: grpc would answer INTERNAL; the method answers INVALID_ARGUMENT."""

    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception as err:  # DecodeError and friends, from protobuf's C core
            return Undecodable(err)

    return parse


def add_to_server(servicer, server) -> None:
    """Registers the Tandem API (as the generated add_TandemServicer_to_server, with lenient parsing)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "ClusterStatus": grpc.unary_unary_rpc_method_handler(
            servicer.ClusterStatus,
            request_deserializer=_lenient(pb.ClusterStatusRequest),
            response_serializer=pb.ClusterStatusResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tandem.v1.Tandem", handlers),)
    )
