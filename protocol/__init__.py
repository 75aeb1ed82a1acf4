"""Everything that crosses a process boundary, declared once: the bottom of the import graph.

Node and verifier both build and check their messages from here; this package imports no
other neuroshard package and no web framework (pynacl for Ed25519, torch nowhere).

Style: frozen dataclasses whose every field is ``Annotated`` with its check (`schema`).
Chosen over pydantic because the peer plane needs what pydantic does not give by default
and the verifier needs nothing pydantic gives that this lacks: one strict JSON parser for
both sides (duplicate keys, NaN, nesting, number length), canonical JSON for signatures,
signing domains, two refusal classes (malformed vs invalid) and cross-field checks with the
numbers in the sentence; the verifier's OpenAPI document takes each body's JSON Schema from
the same declaration (`Message.json_schema`).

Modules and their messages:

- `refusal`   ``Refused(code, detail)``: the one error for anything not accepted; no HTTP status
- `identity`  Ed25519 `verify`, `wallet_id_of`, the `Signer` a message is signed with
- `schema`    strict JSON, canonical JSON, field checks, the `Message` and `Signed` bases
- `signing`   signed requests: signing bytes, the four auth headers, freshness window,
              `verify_request` -> `SignedBy`, the in-memory anti-replay `NonceCache`
- `peer`      peer-plane routes and messages: `PeerRecord`, `PeerList`, `StateInfo`, `ErrorReply`
- `pipeline`  the pipeline's headers: `ActivationHeader`, `GradientReply`, `micro_batch_id`
- `round`     the outer round's objects: `RoundCommitment`, `InputList`, `Dropped`,
              `AggregateClaim`, `Echo`, `RoundDigest`, `EquivocationProof`, `FraudProof`
- `roster`    membership documents: the operator's `Roster` (with `RosterStage`), the verifier's
              `MemberList`, and the registration proof of work (`solve_pow`, `pow_ok`)
- `segments`  a round's segment log: `StepRecord` (with `ReceivedRef`, `SentRef`), `SegmentLog` and
              its root, `SegmentCommitment`; `Received` (a consumed message with its bytes)
- `reports`   what a node tells the verifier: `RegisterRequest`, `HeartbeatRequest`, `Receipt`
              (with `DataSpan`, `AcceptedContribution`, `RejectedContribution`), and the
              operator's `ReinstateRequest`
"""
