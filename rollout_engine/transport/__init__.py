"""Weight updates from another process: packed buckets, control messages over ZeroMQ.

Tensors move in buckets of bounded size, one message and one reply each. How a bucket travels
depends on where the two processes are:

- same GPU (cuda_ipc.py): nothing is packed; each tensor goes as a reference to its storage, which
  both ends keep shared and mapped across updates, and the receiver copies straight out of it;
- CPU (shm.py): packed into one flat POSIX shared-memory segment, with the tensors' metadata (the
  same protocol as on the GPU, so CI runs it);
- separate GPUs or hosts (broadcast.py): packed and broadcast over a process group of its own
  (`init_weight_update_group`; NCCL on CUDA, gloo on the CPU) into one reusable buffer.

Messages are JSON (protocol.py: no pickle on any socket, every field checked, sizes bounded), and
endpoints are loopback TCP or ipc:// sockets in a private directory (endpoints.py). A packed bucket
is acknowledged once it is copied, so the sender may then reuse its buffer (packed transports use
one bucket of extra memory on each side); shared tensors must stay unchanged until send() returns,
whose last reply comes after every copy. Any error on either side ends the update on both: the
sender sends 'abort', the receiver answers the message with the error, and both stay usable.

    engine process:  receiver = WeightReceiver(engine)          # a private ipc:// socket
                     receiver.receive()                         # one whole update
    trainer process: with WeightSender(endpoint) as sender:     # endpoint = receiver.endpoint
                         sender.send(model.named_parameters())  # one update; call it again for the next

Across GPUs both sides first join the group (the trainer is rank 0, and broadcasts), then pass
it to their end of the socket:

    engine:  group = init_weight_update_group("127.0.0.1", 29600, rank=1, world_size=2)
             WeightReceiver(engine, "tcp://127.0.0.1:5555", group=group).receive()
    trainer: group = init_weight_update_group("127.0.0.1", 29600, rank=0, world_size=2)
             WeightSender("tcp://127.0.0.1:5555", group=group).send(model.named_parameters())

and each calls group.close() when it is done with updates.
"""
from .broadcast import WeightUpdateGroup, init_weight_update_group
from .endpoints import check_endpoint, private_ipc_endpoint
from .protocol import WeightUpdateAborted, WeightUpdateRejected
from .receiver import WeightReceiver
from .sender import WeightSender

__all__ = ["WeightReceiver", "WeightSender", "WeightUpdateAborted", "WeightUpdateGroup", "WeightUpdateRejected",
           "check_endpoint", "init_weight_update_group", "private_ipc_endpoint"]
