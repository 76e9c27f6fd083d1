module libbubble/go/bubble

go 1.19
