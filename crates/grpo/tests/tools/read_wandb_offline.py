"""Prints the records of an offline W&B run as JSON lines ({"run"}, {"config"}, {"history"}):
the test of grpo's W&B tracker reads its run back with this. The .wandb file is W&B's record log
(a 7-byte header, then LevelDB log framing in 32 KiB blocks around `Record` protobufs).

  python read_wandb_offline.py WANDB_DIR
"""
import glob, json, struct, sys
from wandb.proto import wandb_internal_pb2 as pb
def records(path):
    data = open(path, 'rb').read()
    assert data[:4] == b':W&B', data[:7]
    pos, block, buf = 7, 32768, b''
    while pos + 7 <= len(data):
        left = block - (pos % block)
        if left < 7:
            pos += left; continue
        _crc, n, t = struct.unpack('<IHB', data[pos:pos + 7])
        if n == 0 and t == 0:
            pos += left; continue
        chunk = data[pos + 7:pos + 7 + n]; pos += 7 + n
        if t == 1: yield chunk
        elif t == 2: buf = chunk
        elif t == 3: buf += chunk
        elif t == 4: yield buf + chunk
for d in records(glob.glob(sys.argv[1] + '/wandb/offline-run-*/run-*.wandb')[0]):
    r = pb.Record(); r.ParseFromString(d)
    k = r.WhichOneof('record_type')
    if k == 'history':
        print(json.dumps({'history': {(i.key or '/'.join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}}))
    elif k == 'config':
        print(json.dumps({'config': {i.key: json.loads(i.value_json) for i in r.config.update}}))
    elif k == 'run':
        print(json.dumps({'run': {'id': r.run.run_id, 'project': r.run.project, 'name': r.run.display_name}}))
        if r.run.config.update:
            print(json.dumps({'config': {i.key: json.loads(i.value_json) for i in r.run.config.update}}))
