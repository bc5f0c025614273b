import sys, time, json, grpc
sys.path.insert(0, '/work/main')
from specdec.common.cost import ReportedCost
from specdec.v1 import common_pb2, verifier_pb2_grpc, drafter_pb2_grpc
addr, daddr, out = sys.argv[1], sys.argv[2], sys.argv[3]
f = open(out, 'w')
while True:
    try:
        rec = {'t': time.time()}
        for role, a, stub in (('v', addr, verifier_pb2_grpc.VerifierServiceStub), ('d', daddr, drafter_pb2_grpc.DrafterServiceStub)):
            with grpc.insecure_channel(a) as ch:
                info = stub(ch).Info(common_pb2.InfoRequest(), timeout=5)
            c = ReportedCost.from_proto(info.forward_cost)
            rec[role] = {
              'buckets': [(e, l.base_ms if hasattr(l,'base_ms') else None, str(l)) for e, l in c.buckets],
              'load': str(c.load),
              'ms': {f'{R}x{n}': round(c.ms(R, n)) for R in (1, 4, 8, 12, 16) for n in (1, 2, 3, 4, 5)},
            }
        f.write(json.dumps(rec) + '\n'); f.flush()
    except Exception as e:
        f.write(json.dumps({'err': str(e)}) + '\n'); f.flush()
    time.sleep(5)
