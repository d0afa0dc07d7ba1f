from tensorferry.cli import main

raise SystemExit(main())
