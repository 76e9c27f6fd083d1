module xlangtask

go 1.19

require libbubble/go/bubble v0.0.0

replace libbubble/go/bubble => ../../../bindings/go
